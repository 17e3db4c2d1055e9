"""Speculative decoding: drafters (`Proposer`s: proposer.py, ngram.py; replay.py for benchmarks) and the engine's
side of it (decoding.py: drafts before each schedule, grammar masks per drafted position, counters)."""
