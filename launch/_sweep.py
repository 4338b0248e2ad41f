"""The loop the test bed's benchmarks (:mod:`.bench_nodes`, :mod:`.bench_spread`) share."""

__all__ = ["sweep"]


def sweep(nodes, rates, topologies, point, format_table):
    """``point(count, rate, topology)`` for every node count, rate and topology (topology
    outermost); each row is printed as it finishes, since a sweep on a slow link takes
    minutes, with the table's header before the first. Returns the points."""
    points = []
    for topology in topologies:
        for rate in rates:
            for count in nodes:
                points.append(point(count, rate, topology))
                print(format_table(points[-1:], header=len(points) == 1), flush=True)
    return points
