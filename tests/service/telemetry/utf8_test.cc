#include "service/telemetry/utf8.h"

#include <string>

#include "gtest/gtest.h"
#include "service/telemetry/telemetry.h"

namespace eps::telemetry {
namespace {

const std::string kE = "\xC3\xA9";         // é, 2 bytes
const std::string kFffd = "\xEF\xBF\xBD";  // U+FFFD
const std::string kEllipsis = "\xE2\x80\xA6";

TEST(Utf8Test, WellFormedTextIsValidAndIllFormedIsNot) {
  for (const std::string& good :
       {std::string(), std::string("plain"), kE, std::string("\xE2\x82\xAC"),
        std::string("\xF0\x9F\x98\x80"), std::string("\xF4\x8F\xBF\xBF")}) {
    EXPECT_TRUE(IsValidUtf8(good)) << good;
  }
  for (const std::string& bad :
       {std::string("\xC3"), std::string("\xFF"), std::string("\x80"), std::string("\xC0\xAF"),
        std::string("\xE0\x80\xAF"),      // overlong
        std::string("\xED\xA0\x80"),      // a surrogate
        std::string("\xF4\x90\x80\x80"),  // past U+10FFFF
        std::string("a\xE2\x82")}) {      // cut
    EXPECT_FALSE(IsValidUtf8(bad)) << bad;
  }
}

TEST(Utf8Test, ScrubReplacesEachMaximalIllFormedSubpartOnce) {
  EXPECT_EQ(ScrubUtf8("ok" + kE), "ok" + kE);
  EXPECT_EQ(ScrubUtf8("a\xE2\x82z"), "a" + kFffd + "z");  // one U+FFFD for the cut sequence
  EXPECT_EQ(ScrubUtf8("\xFF\xFE"), kFffd + kFffd);
  EXPECT_EQ(ScrubUtf8("k=\xFF\xFE\x80"), "k=" + kFffd + kFffd + kFffd);
  EXPECT_TRUE(IsValidUtf8(ScrubUtf8("\xED\xA0\x80 \xC0\xAF")));
}

TEST(Utf8Test, BoundedTextIsCutOnACharacterBoundaryWithAnEllipsisWithinTheLimit) {
  EXPECT_EQ(BoundedUtf8("short", 64), "short");
  EXPECT_EQ(BoundedUtf8(std::string(64, 'a'), 64), std::string(64, 'a'));
  EXPECT_EQ(BoundedUtf8(std::string(65, 'a'), 64), std::string(61, 'a') + kEllipsis);
  // 63 ASCII bytes and a 2-byte character: 65 bytes; the character is not split.
  const std::string cut = BoundedUtf8(std::string(63, 'a') + kE, 64);
  EXPECT_TRUE(IsValidUtf8(cut));
  EXPECT_LE(cut.size(), 64u);
  EXPECT_EQ(cut, std::string(61, 'a') + kEllipsis);
  // A long run of 2-byte characters ends on a whole one.
  std::string many;
  for (int i = 0; i < 100; ++i) many += kE;
  const std::string bounded = BoundedUtf8(many, 64);
  EXPECT_TRUE(IsValidUtf8(bounded));
  EXPECT_LE(bounded.size(), 64u);
  EXPECT_EQ(bounded.substr(bounded.size() - 3), kEllipsis);
  EXPECT_EQ(BoundedUtf8("x\xFFy", 64), "x" + kFffd + "y");
}

// SessionLabel once did substr(0, 64), which could end inside a character: a strict
// receiver then refused the whole batch holding that span.
TEST(Utf8Test, ASessionLabelIsValidUtf8AndBounded) {
  const std::string label = SessionLabel(std::string(63, 'a') + kE);
  EXPECT_TRUE(IsValidUtf8(label)) << label;
  EXPECT_LE(label.size(), kMaxSessionLabelBytes);
  // One of ours keeps its counter and drops the capability, however long the counter part.
  EXPECT_EQ(SessionLabel("s-7-" + std::string(32, 'a')), "s-7");
  const std::string long_ours =
      SessionLabel(std::string(1 << 20, 'x') + "-" + std::string(32, 'b'));
  EXPECT_LE(long_ours.size(), kMaxSessionLabelBytes);
  EXPECT_EQ(SessionLabel(std::string(1 << 20, 'y')).size(), kMaxSessionLabelBytes);
}

}  // namespace
}  // namespace eps::telemetry
