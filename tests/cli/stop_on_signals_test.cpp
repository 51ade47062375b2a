// The plan command's signal handling (tools/tensormem/stop_on_signals.hpp): while it lives,
// SIGINT and SIGTERM set the stop flag once; the handlers the process had are back after it,
// and a signal the process ignored stays ignored throughout.

#include <gtest/gtest.h>

#include <csignal>

#include "stop_on_signals.hpp"

namespace tensormem::cli {
namespace {

void own_handler(int /*sig*/) {}

using handler = void (*)(int);

handler current(int sig) {
  struct sigaction now {};
  sigaction(sig, nullptr, &now);
  return now.sa_handler;
}

class stop_on_signals_test : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int k = 0; k < 2; ++k) sigaction(signals_[k], nullptr, &saved_[k]);
  }
  void TearDown() override {
    for (int k = 0; k < 2; ++k) sigaction(signals_[k], &saved_[k], nullptr);
  }
  static void set(int sig, handler h) {
    struct sigaction a {};
    a.sa_handler = h;
    sigemptyset(&a.sa_mask);
    sigaction(sig, &a, nullptr);
  }
  int signals_[2] = {SIGINT, SIGTERM};
  struct sigaction saved_[2] {};
};

TEST_F(stop_on_signals_test, a_signal_sets_the_flag_once_and_the_old_handlers_come_back) {
  set(SIGINT, &own_handler);
  set(SIGTERM, SIG_DFL);
  {
    const stop_on_signals stop;
    EXPECT_FALSE(stop_on_signals::flag()->load());
    EXPECT_EQ(stop_on_signals::signal(), 0);
    EXPECT_NE(current(SIGINT), &own_handler);
    EXPECT_NE(current(SIGTERM), SIG_DFL);
    ASSERT_EQ(raise(SIGTERM), 0);  // caught: the process goes on
    EXPECT_TRUE(stop_on_signals::flag()->load());
    EXPECT_EQ(stop_on_signals::signal(), SIGTERM);
    EXPECT_EQ(current(SIGTERM), SIG_DFL) << "a second SIGTERM ends the process";
  }
  EXPECT_EQ(current(SIGINT), &own_handler) << "the handler the process had is back";
  EXPECT_EQ(current(SIGTERM), SIG_DFL);
  // A new one starts clear.
  const stop_on_signals again;
  EXPECT_FALSE(stop_on_signals::flag()->load());
  EXPECT_EQ(stop_on_signals::signal(), 0);
}

TEST_F(stop_on_signals_test, an_ignored_signal_stays_ignored) {
  set(SIGINT, SIG_IGN);
  set(SIGTERM, &own_handler);
  {
    const stop_on_signals stop;
    EXPECT_EQ(current(SIGINT), SIG_IGN);
    EXPECT_NE(current(SIGTERM), &own_handler);
    ASSERT_EQ(raise(SIGINT), 0);
    EXPECT_FALSE(stop_on_signals::flag()->load());
  }
  EXPECT_EQ(current(SIGINT), SIG_IGN);
  EXPECT_EQ(current(SIGTERM), &own_handler);
}

}  // namespace
}  // namespace tensormem::cli
