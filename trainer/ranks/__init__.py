"""Ranks and sharding: the ranks launcher (`python -m trainer.ranks`), the nodes, DCP over our store."""
