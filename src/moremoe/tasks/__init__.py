"""Tasks: the phonebook memorisation task, prepared text and the pretraining mixture."""
