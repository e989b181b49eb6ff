"""Generation in a front end: text in, token ids to the engine, token ids back to text.

The engine sees token ids only (``bridge.interface.GenerateRequest``); everything textual is
here, shared by the OpenAI-compatible routes (``frontend/openai/``) and the Open Inference
Protocol's generate extension (``frontend/oip/generate.py``):

- ``text_model``: a generative version's tokenizer, chat template and generation defaults,
  read from its verified files;
- ``chat_template``: a chat rendered with the version's template, as ``transformers`` does;
- ``sampling``: the sampling settings a request may set, checked, and the engine requests
  they make (one per choice);
- ``choices``: the engine's token events of one choice turned into text (incremental
  detokenizing, stop strings cut exactly), and several choices merged into one stream.
"""
