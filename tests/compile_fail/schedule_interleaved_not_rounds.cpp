// Interleaved 1F1B with a number of micro-batches that is not a multiple of P.
#include <fived/pipeline/schedule.hpp>
int main() { return fived::pipeline::Interleaved1F1B<4, 6, 2>::figures.makespan; }
