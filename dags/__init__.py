"""The step graphs: builders, the tokens on their edges, renderings."""
