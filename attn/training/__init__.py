"""The parts of a training run beside its loop (:mod:`attn.train`), each in a module of its own:

    config        TrainConfig, the recipes, the settings a resumed run keeps, the attn-train command line
    prepare       corpus and split, vocabulary, model and optimizer, the warm-up fitted to the budget
    checkpoints   the training state, checkpoints, snapshots and their average, the files of ``out``
    evaluation    validation loss and BLEU during training, the test at the end, metrics.json
    distributed   several processes (mpiexec) or GPUs training one model as one process would

The loop calls them by name; a run of one process never touches :mod:`.distributed` beyond
asking it how many processes there are.
"""
