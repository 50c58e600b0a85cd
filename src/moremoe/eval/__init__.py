"""Evaluation: routing statistics (H_norm) and phonebook exact match."""
