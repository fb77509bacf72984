"""Infiniswap: remote-memory paging over a block device (thesis chapter 2)."""
