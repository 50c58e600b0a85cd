"""Language-model training: the run's config, the trainer's loop, its data, optimizer,
checkpoints and metrics (the phonebook's own trainer lives in moremoe.phonebook)."""
