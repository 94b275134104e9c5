"""An example mlx-dspark plugin: the bigram-table drafter kind."""
