"""OpenAI's API for text generation (``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``), so that the clients people have (the ``openai`` SDK, LangChain, LlamaIndex)
work unchanged: request schemas, errors in OpenAI's shape, and one module per route."""
