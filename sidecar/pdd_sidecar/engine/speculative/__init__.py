"""Speculative decoding: drafts proposed cheaply, verified by the target model in one step."""
