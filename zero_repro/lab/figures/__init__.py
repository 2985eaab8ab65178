"""Tables and figures regenerated from records, with the paper's values overlaid; the throughput
figure family (Figures 2, 3, 4, 8)."""
