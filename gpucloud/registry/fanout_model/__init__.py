"""A design model, not a fake of a running component: a discrete-event simulator of fanning one
weight artifact out to a fleet of GPU nodes (`simulation.simulate`).

It answers the design question of ARCHITECTURE.md "Weights" -> Distribution: how long until
every node holds the artifact, and how many bytes leave the origin, for three strategies:

- ``origin_only``: every node fetches every chunk from the origin.
- ``tiered_mirrors``: the first node of each rack mirrors the origin; the rest of the rack
  fetches from its mirror (chunk by chunk, as soon as the mirror holds one).
- ``p2p``: a swarm. Each node keeps a few fetches in flight, picks the rarest chunk it lacks that
  a peer with a free upload slot holds (chunks its own rack can serve first; a chunk its rack
  already holds or is receiving is never fetched across racks again), and asks the tracker
  (`gpucloud.registry.tracker`, the same code the control plane runs) for the source: rack-local
  peers first, then other racks, least loaded first. The origin serves only chunks no node holds
  yet, so each chunk leaves it once.

Network model (flow level): nodes sit in racks; each NIC is full duplex with its own upload and
download capacity; the origin, outside every rack, has its own egress; racks optionally have an
oversubscribed uplink (traffic leaving a rack, and traffic entering it, origin traffic included,
each share ``nodes_in_rack x NIC / oversubscription``). A transfer runs at ``min`` over the links
it crosses of ``capacity / transfers on that link``, recomputed whenever a transfer starts or
ends on one of those links, so no link ever carries more than its capacity. That is fair sharing
per link without max-min redistribution (a transfer held back by one end leaves the other end's
unused share idle), so it understates what TCP would achieve and the swarm's figures err on the
slow side. Sources cap their concurrent uploads (``upload_slots``, ``origin_slots``): the origin
and mirrors queue further requests FIFO; swarm peers at the cap are skipped by the tracker.
Chunks are store-and-forward: a node serves a chunk only once it holds (and has verified) all of
it.

Approximation, for run time: the simulator moves "pieces" of whole chunks. When
``nodes x chunks`` exceeds ``max_transfers`` it groups consecutive chunks into pieces so that
about ``max_transfers`` transfers happen (141 GB in 64 MiB chunks to 1,000 nodes: 8 chunks =
512 MiB per piece, 263 pieces). The bandwidth arithmetic is unchanged; only store-and-forward
granularity coarsens, which lengthens the swarm's pipeline (by at least
``depth x (piece - chunk) / NIC``, 0.38 s there) and makes its end game lumpier, so results err on
the slow side: on that run, pieces of 4 chunks instead of 8 take p2p's p99 from 1.21x to 1.12x of
the bound, at twice the run time.

Lower bound (`lower_bound_s`): ``size / NIC + depth x chunk / NIC`` with
``depth = ceil(log2(nodes))``. The first term is the largest of three delivery floors: every node
takes the whole artifact in through its NIC (``size / down``), every byte leaves the origin at
least once (``size / origin``), and the fleet's total upload carries N copies
(``N x size / (N x up + origin)``, which matters only when uploads are slower than downloads).
The second: a holder makes one new copy of a chunk per ``chunk / NIC up``, so copies of the last
chunk at most double per chunk time and reaching N nodes takes ``ceil(log2 N)`` more. With equal
capacities this is, to within a round, the optimal makespan of chunk-by-chunk dissemination
(M rounds plus about log2 N: Mundinger, Weber and Weiss, "Optimal scheduling of peer-to-peer file
dissemination", J. Scheduling 2008), and the figure ARCHITECTURE.md quotes (about 11.3 s for
141 GB at 100 Gb/s). It is a yardstick for the design's regime (many nodes, an origin no faster
than a few NICs), not a theorem for every configuration: a handful of nodes fed straight from a
fast origin can beat the depth term, and oversubscribed rack uplinks are not in it.
"""
