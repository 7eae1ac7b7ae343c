// test_ep_exposure.cpp: the exposed-EP-time interval arithmetic (src/model/ep_exposure.h) on hand-made spans,
// and the shared recorder's totals. Not a measurement of a run (bench/ep_overlap.sh does that).
#include <gtest/gtest.h>

#include "model/ep_exposure.h"

using moetron::EpExposure;
using moetron::exposed_seconds;
using moetron::TimeSpan;

TEST(EpExposure, NoComputeAllWaitIsExposed) {
  EXPECT_DOUBLE_EQ(exposed_seconds({{0, 1}, {2, 3.5}}, {}), 2.5);
}

TEST(EpExposure, OverlappingWaitsCountOnce) {
  // two lanes waiting at once: [0, 2] and [1, 3] are 3 s of waiting, not 4
  EXPECT_DOUBLE_EQ(exposed_seconds({{1, 3}, {0, 2}}, {}), 3.0);
}

TEST(EpExposure, ComputeCoversPartOfWaits) {
  // waits [0,4] and [6,10]; the other lane computes [1,2], [3,7] (crosses the gap) and [9,12]
  // covered: [1,2] 1 + [3,4] 1 + [6,7] 1 + [9,10] 1 = 4 of 8 s
  EXPECT_DOUBLE_EQ(exposed_seconds({{6, 10}, {0, 4}}, {{9, 12}, {3, 7}, {1, 2}}), 4.0);
}

TEST(EpExposure, OverlappingBusySpansAndFullCover) {
  EXPECT_DOUBLE_EQ(exposed_seconds({{1, 2}}, {{0, 1.5}, {1.2, 3}}), 0.0);
  EXPECT_DOUBLE_EQ(exposed_seconds({{1, 2}}, {{2, 3}, {-1, 1}}), 1.0);  // touching only: nothing covered
}

TEST(EpExposure, EmptyAndReversedSpansCountNothing) {
  EXPECT_DOUBLE_EQ(exposed_seconds({{1, 1}, {3, 2}, {0, 0.5}}, {{5, 4}}), 0.5);
}

TEST(EpExposure, RecorderFoldsIntoTotals) {
  EpExposure e;
  e.wait(0, 2), e.busy(1, 3);  // 1 s of 2 exposed
  e.fold();
  e.wait(10, 11);  // after a fold, an earlier busy span no longer covers anything
  EXPECT_DOUBLE_EQ(e.wait_total(), 3.0);
  EXPECT_DOUBLE_EQ(e.exposed_total(), 2.0);
  e.busy(20, 30);  // busy without waits adds nothing
  EXPECT_DOUBLE_EQ(e.exposed_total(), 2.0);
}

TEST(EpExposure, PairedFoldsAreKeptApart) {
  EpExposure e;
  e.wait(0, 2);  // an action alone: 2 s exposed, not paired
  e.fold();
  e.wait(5, 8), e.busy(6, 7);  // one overlapped pair: 2 s of 3 exposed
  e.fold(true);
  e.wait(9, 10);  // alone again, folded by the total
  EXPECT_DOUBLE_EQ(e.exposed_total(), 5.0);
  EXPECT_DOUBLE_EQ(e.exposed_paired_total(), 2.0);
}
