"""serve: HTTP in three rooms, imported one way (tests/unit/test_serve_rooms.py).

- ``openai/``: the OpenAI surface; imports no other room.
- ``router/`` and ``instance/``: each may import ``openai/``, never each other.
- Shared here: ``event_loop``, ``discovery``, ``access_log`` (which import no room), and
  ``local_stack``, which launches the whole stack and which no room imports.
"""
