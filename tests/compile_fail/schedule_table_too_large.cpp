// A table whose actions do not fit in an int each (18 x M x V x (P + 1) > INT_MAX).
#include <fived/pipeline/schedule.hpp>
int main() { return fived::pipeline::Table<4096, 32768, 8>::ranks; }
