"""The broker's asyncio HTTP front: one event loop answers health and metrics itself, holds
waiting clients (long polls, ``Prefer: wait``, server-sent events) as futures, and runs the
Flask app for everything else in a bounded thread pool (docs/architecture.md, *Runtime*).
"""
