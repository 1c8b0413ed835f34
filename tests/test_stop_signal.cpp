// A signal that asks a run to stop after its step (train/stop_signal.hpp): caught while a
// StopSignal lives, the first one's number kept, a second one soon after the same request, one
// a second later the end, and the handlers found before put back.

#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <stdexcept>
#include <thread>

#include "fived/train/stop_signal.hpp"

using namespace fived;

namespace {

volatile std::sig_atomic_t before_count = 0;
void counting_handler(int) { before_count = before_count + 1; }

}  // namespace

TEST_CASE("a StopSignal turns SIGTERM, SIGINT and SIGUSR1 into a request; the first signal is the one named") {
  StopSignal stop;
  CHECK(!stop.requested());
  CHECK(stop.signal() == 0);
  std::raise(SIGUSR1);
  CHECK(stop.requested());
  CHECK(stop.signal() == SIGUSR1);
  CHECK(stop.name() == "SIGUSR1");
  std::raise(SIGTERM);  // still the first one's
  CHECK(stop.name() == "SIGUSR1");
  std::raise(SIGUSR1);  // again at once (as `timeout` sends it twice): the same request
  CHECK(stop.requested());
}

TEST_CASE("a second signal a second or more after the first takes its default action: the process ends") {
  const pid_t child = fork();
  REQUIRE(child >= 0);
  if (child == 0) {  // the child: caught once, then ended by the second
    StopSignal stop;
    std::raise(SIGTERM);
    if (!stop.requested()) _exit(1);
    std::this_thread::sleep_for(std::chrono::milliseconds(1100));
    std::raise(SIGTERM);
    _exit(2);  // not reached
  }
  int status = 0;
  REQUIRE(waitpid(child, &status, 0) == child);
  CHECK(WIFSIGNALED(status));
  CHECK(WTERMSIG(status) == SIGTERM);
}

TEST_CASE("a StopSignal catches the signals it is given, once each, and puts back the handlers it found") {
  std::signal(SIGUSR2, counting_handler);
  {
    StopSignal stop({SIGUSR2});
    CHECK_THROWS_AS(StopSignal{}, std::logic_error);  // one at a time
    std::raise(SIGUSR2);
    CHECK(stop.name() == "SIGUSR2");
    CHECK(before_count == 0);
  }
  std::raise(SIGUSR2);  // the handler found before is back
  CHECK(before_count == 1);
  StopSignal again;  // and another may be made now
  CHECK(!again.requested());
  std::signal(SIGUSR2, SIG_DFL);
}
