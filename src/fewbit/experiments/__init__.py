"""The paper's experiments as library code: data, the char GPT, training runs, sweeps."""
