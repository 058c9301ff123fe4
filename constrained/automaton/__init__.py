"""The spruce backend: a regex as a byte-level NFA (byte_nfa.py), determinized lazily
(byte_dfa.py), token masks walked on the vocabulary's byte trie (token_trie.py) and cached per
state (grammar.py), and the per-request cursor (cursor.py; its jump-forward base is every
backend's)."""
