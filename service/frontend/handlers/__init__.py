"""A version's pre- and post-processing, run in the front ends (``base.Handler``).

The built-in handlers, named by a manifest's ``handler.import_path``:

- ``service.frontend.handlers.base:Handler``: tensors in, tensors out (what a version without
  a handler gets);
- ``service.frontend.handlers.classification:ClassificationHandler``: tensors in, top-k
  labels out;
- ``service.frontend.handlers.text:TextHandler``: strings in (the version's tokenizer), top-k
  labels or tensors out;
- ``service.frontend.handlers.tokens:TokenClassificationHandler``: strings in, each token's
  label with its character offsets (or grouped entities) out, as HF's token-classification
  pipeline;
- ``service.frontend.handlers.image:ImageHandler``: PNG or JPEG in, top-k labels or tensors
  out.

Each module says its options and query parameters. Nothing is imported here, so a version
that needs no tokenizer or image decoding never loads ``tokenizers`` or Pillow.
"""
