"""Studies: many pretraining runs planned, trained, resumed and reported together.

``moremoe study lm`` measures the paper's language-model claims at a scale one GPU can train
(study/plan.py plans the runs from the matched-FLOP planner, study/runner.py trains them as
processes of ``moremoe train``, several at once, study/rows.py keeps one row per finished
run, study/report.py and study/plots.py turn the rows into verdicts and figures).
"""
