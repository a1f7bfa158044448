"""`specserve train-head`: self-distilled training of draft heads (EAGLE-3, EAGLE-1, Medusa) on a CPU budget.

instructions.py reads the instructions (bundled, or a user's file, which `specserve serve
--record-prompts` writes); data.py has the target answer them (and cuts standard-library text);
features.py reads the target's features and top-k distributions off teacher-forced
forwards; eagle.py and medusa.py own each method's head and loss; loop.py trains with
checkpoints and measures held-out agreement; run.py is the command: phases, budget,
resume, and the finished head in the cache.
"""
