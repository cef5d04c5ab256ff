"""The OpenAI surface: parsing and checking requests (fields, tools, structured output), and
writing answers (choices, logprobs, tool calls, SSE chunks, detokenized text), plus API keys.

The lowest room: it imports neither the router nor the instances, so both can use it.
"""
