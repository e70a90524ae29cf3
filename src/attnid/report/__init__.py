"""Reports: figures, tables and the reproduction report."""
