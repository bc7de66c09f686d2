"""The OpenAI surface: chat and text completions and the model list (``routes``), the Responses
API (``responses``; its store: ``neuron/response_store.py``), tokenize and detokenize (``tokenize``). A body is read
into sequences (``requests``, ``prompts``, ``planning``, ``tools``, ``structured``, ``fields``) and
their event streams are written back as chunks or whole objects (``generation``, ``choices``,
``views``)."""
