"""``batchserve tune``: the settings that serve one model best on this host, measured.

``tune`` measures the model's limit in process and the HTTP ceiling, then serves the model
under closed-loop load for a small guided search (``search``), re-measures the winner against
the defaults in interleaved rounds, and writes the winner's ``BATCHSERVE_*`` settings and a
report. Pure planning lives in ``space`` and ``search``; measuring in ``model_limit``,
``ceiling``, ``load`` and ``trials``; the run itself in ``tune``.
"""
