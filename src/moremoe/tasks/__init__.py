"""Text for training: corpora, prepared token data, the pretraining mixture and its recipes
(the phonebook task lives in moremoe.phonebook)."""
