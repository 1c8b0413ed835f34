// 1F1B with fewer micro-batches than pipeline ranks.
#include <fived/pipeline/schedule.hpp>
int main() { return fived::pipeline::OneFOneB<4, 3>::figures.makespan; }
