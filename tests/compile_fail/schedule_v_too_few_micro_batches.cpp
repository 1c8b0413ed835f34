// The V schedule with fewer than 2P micro-batches.
#include <fived/pipeline/schedule.hpp>
int main() { return fived::pipeline::ZBV<4, 7>::figures.makespan; }
