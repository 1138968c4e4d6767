"""DESIGN step 8, bytes to the worker and back: the relay of one request and its usage, the prefill
leg of a split request."""
