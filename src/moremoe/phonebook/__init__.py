"""The phonebook memorisation experiment (the paper's Section 3 and 4.1), in one place.

    task.py         the phonebook: names, numbers, their tokens and batches
    score.py        exact match and digit accuracy of a model on entries
    step.py         one training step, eager, compiled or captured as a CUDA graph
    trainer.py      one run: its config, model, learning-rate calibration and stopping rule
    search.py       plans of runs: a trial, the capacity search, the learning-rate grid
    pool.py         many runs at once (streams on a GPU, one process a GPU), checkpointed
    journal.py      the journal of finished runs and the trial checkpoints, as files
    paper.py        the paper's points (tab:phonebook_configs_h/_s, the rank figure) and
                    its protocol
    bench.py        `moremoe bench phonebook`: the step's time, eager, graph and the loop
    plots.py        a run's curves, a capacity search, a sweep
    paper_plots.py  the reproduction's figures beside the paper's values

The commands (`moremoe phonebook train|capacity|sweep|reproduce`, `moremoe demo`, `moremoe
bench phonebook`) are thin parsers in moremoe/cli over these modules.
"""
