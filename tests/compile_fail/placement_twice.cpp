// Two placements for the TP axis are rejected.
#include <fived/place/placement.hpp>
using P = fived::Placements<fived::On<fived::Axis::tp, fived::Shard<0>>, fived::On<fived::Axis::tp, fived::Partial>>;
int main() { return sizeof(P) > 0 ? 0 : 1; }
