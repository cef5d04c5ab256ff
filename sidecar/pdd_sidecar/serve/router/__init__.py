"""The router: the OpenAI HTTP app, the routing policy, the replicas it probes, the upstream
calls through a prefill and a decode, its warm-up, its worker processes.

It imports the OpenAI room and serve/'s shared modules, never the instances' HTTP.
"""
