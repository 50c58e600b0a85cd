"""The expert shapes `moremoe bench experts --shapes` times: the paper's points and those of
the training presets, the study pair and the phonebook models, each at its own micro-batch
(the CLI may import every layer; moremoe.bench may not import training, study or
phonebook)."""
from __future__ import annotations

EXPERT_SHAPES = ("paper", "presets", "study", "phonebook")     # bench experts --shapes


def expert_points(shapes) -> list:
    """[(label, LayerPoint)] of `bench experts`: the paper's points (h = 512, N = 262,144),
    every training preset's expert shape at its micro-batch, the study pair's, and the
    phonebook models' (a step of 1,024 entries of 16 tokens); one point a distinct shape,
    labelled by all that use it."""
    from ..bench.layer import PAPER_EXPERT_POINTS, LayerPoint
    found: dict = {}

    def add(label, p):
        found.setdefault(p, []).append(label)
    if "paper" in shapes:
        for label, p in PAPER_EXPERT_POINTS:
            add(label, p)
    if "presets" in shapes:
        from ..training.presets import PRESETS, get_preset
        for name, args in PRESETS.items():
            if len(args) == 4:                          # not the tiny or PEER presets
                m, t = (c := get_preset(name)).model, c.train
                add(name, LayerPoint(m.hidden, m.experts, s=m.width, k=m.top_k,
                                     N=t.batch_size * m.seq_len))
    if "study" in shapes:
        from ..study.plan import StudySettings, base_pair
        st = StudySettings()
        for m in base_pair(st):
            add(f"study {m['kind']}-{m['experts']}", LayerPoint(
                st.hidden, m["experts"], s=m["width"], k=st.top_k, N=st.tokens_per_step))
    if "phonebook" in shapes:
        from ..phonebook.bench import BATCH, MODELS
        from ..phonebook.task import SEQ_LEN
        for name, c in MODELS.items():
            add(f"phonebook {name}", LayerPoint(c.hidden, c.experts, s=c.width, k=c.top_k,
                                                N=BATCH * SEQ_LEN))
    return [(", ".join(labels), p) for p, labels in found.items()]
