"""Tasks: the phonebook memorisation task, and prepared text for pretraining."""
