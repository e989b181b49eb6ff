"""Token-by-token generation for causal LMs: continuous batching over a slot KV cache.

``ContinuousBatch`` is what a device thread drives (``submit``, ``cancel``, ``step``); the
rest are its parts, each usable alone: the admission policy (``admission``), the cache
(``kv_cache``), the inputs of a forward over rows of different lengths (``forward_inputs``),
sampling (``sampling``), and what a model's files say about stopping (``model_limits``).
Encoder-decoder models (T5, BART) step in cohorts instead (``cohorts.CohortBatch``, the
same ``submit``, ``cancel`` and ``step``).
Text (detokenizing, stop strings) is the front ends' and lives in ``service/detokenizer.py``
and ``service/stop_strings.py``. The package imports ``transformers`` (``kv_cache``): import
it only where a generative version is served.
"""
