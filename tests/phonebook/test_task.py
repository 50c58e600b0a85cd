"""The phonebook: tokenizer round trip, determinism, uniqueness, loss positions."""
import pytest
import torch

from moremoe.model import IGNORE_INDEX
from moremoe.phonebook import task as pb


def test_vocabulary():
    assert pb.VOCAB_SIZE == 40 and len(set(pb.VOCAB)) == 40


def test_encode_decode_round_trip():
    text = "$abcde|12345678."
    ids = pb.encode(text)
    assert len(ids) == 16 and pb.decode(ids) == text
    short = pb.encode("$ab|1.")
    assert len(short) == 16 and pb.decode(short, strip_pad=False) == "$ab|1." + "*" * 10
    with pytest.raises(ValueError, match="'A' is not in the phonebook vocabulary"):
        pb.encode("$Abcde|1.")
    with pytest.raises(ValueError, match="more than pad_to=16"):
        pb.encode("$abcde|123456789012.")


def test_tokens_decode_to_entries_and_are_deterministic():
    book = pb.Phonebook(500, seed=3)
    tokens = book.tokens()
    assert tokens.shape == (500, 16) and tokens.dtype == torch.int64
    for i in (0, 17, 499):
        assert pb.decode(tokens[i]) == book.entry(i)
        name, number = book.entry(i)[1:6], book.entry(i)[7:15]
        assert name.isalpha() and name.islower() and number.isdigit() and len(number) == 8
    assert torch.equal(pb.Phonebook(500, seed=3).tokens(), tokens)
    assert not torch.equal(pb.Phonebook(500, seed=4).tokens(), tokens)


def test_names_unique_and_numbers_spread():
    book = pb.Phonebook(20000, seed=0)
    names = book.tokens()[:, 1:6]
    assert torch.unique(names, dim=0).shape[0] == 20000
    assert book.numbers.min() >= 0 and book.numbers.max() < 10 ** 8
    assert book.numbers.max() > 9 * 10 ** 7  # uses the whole number range


def test_size_errors():
    with pytest.raises(ValueError, match="size must be an int in"):
        pb.Phonebook(0)
    with pytest.raises(ValueError, match="size must be an int in"):
        pb.Phonebook(26 ** 5 + 1)


def test_loss_positions():
    tokens = pb.Phonebook(4).tokens()
    inputs, targets = pb.inputs_and_targets(tokens, "number")
    assert inputs.shape == targets.shape == (4, 15)
    carried = (targets != IGNORE_INDEX).nonzero()[:, 1].unique().tolist()
    assert carried == list(range(6, 15))        # predictions of the 8 digits and '.'
    assert pb.decode(targets[0, 6:]) == pb.decode(tokens[0, 7:])
    _, all_targets = pb.inputs_and_targets(tokens, "all")
    assert (all_targets != IGNORE_INDEX).all()
    with pytest.raises(ValueError, match="loss_on must be one of"):
        pb.inputs_and_targets(tokens, "digits")


def test_eval_indices_sample_without_replacement():
    book = pb.Phonebook(3000)
    idx = book.eval_indices(1000)
    assert idx.unique().numel() == 1000 and int(idx.max()) < 3000
    assert pb.Phonebook(10).eval_indices(1000).numel() == 10
