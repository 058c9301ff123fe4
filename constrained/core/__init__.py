"""What every part of spruce.constrained shares: the one error type, memory budgets and
byte-bounded caches, packed token bitmasks, regex spellings of choices and dtypes, integer
ranges, linear-time regex matching (RE2) and jump-forward planning. Imports nothing above it."""
