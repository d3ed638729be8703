"""The figures ``peftlab plot`` draws: :mod:`.paper` (the paper style, labels, layout), :mod:`.cells` (heatmap
cells, best cell by paired CI), :mod:`.heatmap` (lr-grid / heatmap), :mod:`.curves` (learning curves),
:mod:`.points` (metric vs a key), :mod:`.sigma` (KaSA Δσ)."""
