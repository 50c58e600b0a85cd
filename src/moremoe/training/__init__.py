"""Training loops: the phonebook trainer (LR calibration, early stopping, capacity search)."""
