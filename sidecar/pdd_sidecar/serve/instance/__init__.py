"""The instances' HTTP: the prefill's and the decode's endpoints over the engine, the vLLM
protocol, and the server that runs one of them.

It imports the OpenAI room and serve/'s shared modules, never the router.
"""
