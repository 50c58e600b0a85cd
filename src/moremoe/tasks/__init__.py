"""Tasks: the phonebook memorisation task."""
