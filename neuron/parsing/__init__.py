"""Model output to API shapes, as it streams: tool calls in each model's syntax (``tool_calls``,
``call_reader``), thinking between reasoning markers (``reasoning``), and the search for markers in
text that arrives in pieces that both share (``markers``). Structured output needs no parser of its
own: its grammar makes the text what the request asked for, and it is returned as content."""
