"""A sequence's output on the API side: the ids its engine draws become text (``detokenizer``),
held back where they could begin a stop string (``stops``), and events on the queue its route
reads (``state``). In one process the engine calls the state directly; with API processes the
core's ``Outputs`` frames do (``neuron/server/core_link.py``)."""
