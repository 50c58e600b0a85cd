"""Exact match by one teacher-forced pass equals step-by-step greedy decoding."""
import torch

from moremoe.phonebook.score import greedy_decode, score
from moremoe.model import Transformer
from moremoe.nn import MoEConfig
from moremoe.phonebook import task as pb
from moremoe.phonebook.trainer import phonebook_model_config


def test_score_agrees_with_greedy_decode():
    torch.manual_seed(0)
    model = Transformer(phonebook_model_config(MoEConfig.more(12, 2, 32, 8, 4), layers=1))
    # make every greedy token a digit, which digit depending on the context
    head = torch.nn.Linear(32, pb.VOCAB_SIZE, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight * 50)
        head.bias.zero_()
        head.bias[26:36] = 1e4
    model.lm_head = head
    book = pb.Phonebook(40)
    tokens = book.tokens().clone()
    decoded = greedy_decode(model, [book.name(i) for i in range(40)])
    assert all(d.isdigit() and len(d) == 8 for d in decoded)
    for i in range(0, 40, 2):   # plant the model's own answer in every other entry
        tokens[i, 7:15] = torch.tensor(pb.encode(decoded[i], pad_to=None))
    for i in (1, 3):            # and a single wrong last digit in two of the rest
        tokens[i, 7:15] = torch.tensor(pb.encode(decoded[i], pad_to=None))
        tokens[i, 14] = 26 + (tokens[i, 14] - 26 + 1) % 10
    s = score(model, tokens)
    expected = sum(decoded[i] == pb.decode(tokens[i, 7:15]) for i in range(40)) / 40
    assert s.exact_match == expected and 0.5 <= expected < 0.6
    assert s.char_accuracy > s.exact_match and s.entries == 40
