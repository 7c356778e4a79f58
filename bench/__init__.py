"""The benchmark suite (`make bench`); see README.md."""
