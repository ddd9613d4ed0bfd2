"""Kernels for a sequence split over ranks: ring attention, TokenRing, halos, split scans."""
