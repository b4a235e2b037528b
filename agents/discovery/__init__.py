"""Discovery backends: how an agent learns what its node has."""
