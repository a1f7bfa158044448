"""Structured outputs: an answer held to a regex, a JSON schema, any JSON object, or one
of a list of choices (vLLM's `guided_*`, OpenAI's `response_format`).

Each kind becomes a regex (json_schema.py), the regex a DFA (regex.py), and the DFA a
`Guide` over the target's vocabulary (guide.py), which the engine reads as one more
logits processor (specserve/penalties.py), on the target's rows and the proposers'
guesses alike, so speculation stays lossless under it. What a request asks for is a
`StructuredOutput` (outputs.py); a `GuideCache` (guide.py) compiles and keeps them.
"""
