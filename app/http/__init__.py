"""The HTTP edge: the app factory, plain-ASGI hot routes, FastAPI for the rest, statuses, auth, admission.

Everything HTTP lives here; tokenizer_service.core knows nothing of it (tests/test_layers.py holds the rule).
"""
