"""Expert parallelism: dispatch tokens to the ranks that hold their experts, and combine the results (lecture 03)."""
