// In-process tests of descriptor validation (service/descriptor.h): every
// refusal is INVALID_ARGUMENT or FAILED_PRECONDITION naming the buffer.
#include "service/descriptor.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "service/host_memory.h"

namespace eps::service {
namespace {

using ::testing::HasSubstr;

TensorSpec QueriesSpec() {
  return {"queries", v1::DTYPE_FLOAT32, {2, 4, 8}, {"num_layers", "max_batch", "head_dim"}};
}

v1::MemoryDescriptor Inline(std::initializer_list<int64_t> shape,
                            v1::DType dtype = v1::DTYPE_FLOAT32) {
  v1::MemoryDescriptor d;
  d.mutable_inline_bytes()->set_data("");
  for (int64_t dim : shape) d.add_shape(dim);
  d.set_dtype(dtype);
  return d;
}

// A POSIX shm object of `size` bytes, unlinked at scope exit.
class ShmObject {
 public:
  explicit ShmObject(uint64_t size)
      : name_("/eps-descriptor-test-" + std::to_string(getpid()) + "-" + std::to_string(next_++)) {
    const int fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    EXPECT_GE(fd, 0);
    EXPECT_EQ(ftruncate(fd, static_cast<off_t>(size)), 0);
    close(fd);
  }
  ~ShmObject() { shm_unlink(name_.c_str()); }
  v1::MemoryDescriptor Descriptor(uint64_t size, uint64_t offset,
                                  std::initializer_list<int64_t> shape) const {
    v1::MemoryDescriptor d;
    d.mutable_host_shm()->set_name(name_);
    d.mutable_host_shm()->set_size(size);
    d.set_offset(offset);
    for (int64_t dim : shape) d.add_shape(dim);
    d.set_dtype(v1::DTYPE_INT32);
    return d;
  }

 private:
  static inline int next_ = 0;
  std::string name_;
};

TEST(DescriptorTest, AnInlineTensorResolvesToItsShapeAndBytes) {
  MappingCache cache;
  absl::StatusOr<MappedTensor> t = ResolveTensor(Inline({2, 4, 8}), QueriesSpec(), cache);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->shape, (std::vector<int64_t>{2, 4, 8}));
  EXPECT_EQ(t->bytes, 2u * 4 * 8 * 4);
  EXPECT_TRUE(t->is_inline);
  EXPECT_FALSE(t->is_device);
}

TEST(DescriptorTest, AWrongDTypeNamesBothTypes) {
  MappingCache cache;
  EXPECT_EQ(
      ResolveTensor(Inline({2, 4, 8}, v1::DTYPE_INT32), QueriesSpec(), cache).status().message(),
      "queries.dtype=DTYPE_INT32, want DTYPE_FLOAT32");
}

TEST(DescriptorTest, AWrongRankListsTheDimensionsWanted) {
  MappingCache cache;
  EXPECT_EQ(ResolveTensor(Inline({2, 4}), QueriesSpec(), cache).status().message(),
            "queries has rank 2, want 3 [num_layers, max_batch, head_dim]");
}

TEST(DescriptorTest, AFixedDimensionMismatchNamesWhatItMustEqual) {
  MappingCache cache;
  EXPECT_EQ(ResolveTensor(Inline({2, 5, 8}), QueriesSpec(), cache).status().message(),
            "queries.shape[1]=5 does not match max_batch=4");
  EXPECT_THAT(ResolveTensor(Inline({2, 0, 8}), QueriesSpec(), cache).status().message(),
              HasSubstr("queries.shape[1]=0 must be >= 1"));
}

TEST(DescriptorTest, NonContiguousStridesAreRefused) {
  MappingCache cache;
  v1::MemoryDescriptor d = Inline({2, 4, 8});
  for (int64_t s : {32, 8, 2}) d.add_strides(s);
  EXPECT_THAT(ResolveTensor(d, QueriesSpec(), cache).status().message(),
              HasSubstr("queries.strides[2]=2, want 1"));
}

TEST(DescriptorTest, AnOverflowingShapeIsRefused) {
  MappingCache cache;
  TensorSpec spec{"big", v1::DTYPE_FLOAT32, {-1, -1}, {"a", "b"}};
  EXPECT_THAT(
      ResolveTensor(Inline({int64_t{1} << 40, int64_t{1} << 40}), spec, cache).status().message(),
      HasSubstr("big.shape overflows int64"));
}

TEST(DescriptorTest, AMisalignedOffsetIsRefused) {
  ShmObject shm(4096);
  MappingCache cache;
  TensorSpec spec{"group_table", v1::DTYPE_INT32, {-1, -1}, {"max_seqs", "max_groups"}};
  EXPECT_EQ(ResolveTensor(shm.Descriptor(4096, 6, {2, 2}), spec, cache).status().message(),
            "group_table.offset=6 is not aligned to its 4-byte elements");
}

// The summary pool's records are read 16 bytes at a time on the GPU: an offset
// aligned to its 4-byte elements but not to 16 bytes is refused, one that is is not.
TEST(DescriptorTest, AnAlignmentBeyondTheElementsIsEnforced) {
  ShmObject shm(4096);
  MappingCache cache;
  TensorSpec spec{"summary_pool", v1::DTYPE_INT32, {-1, -1}, {"slots", "record_words"}};
  spec.alignment = 16;
  EXPECT_EQ(ResolveTensor(shm.Descriptor(4096, 4, {2, 4}), spec, cache).status().message(),
            "summary_pool.offset=4 is not a multiple of 16 bytes (its records are read 16 bytes "
            "at a time)");
  EXPECT_TRUE(ResolveTensor(shm.Descriptor(4096, 32, {2, 4}), spec, cache).ok());
}

TEST(DescriptorTest, AnExtentBeyondTheObjectIsRefused) {
  ShmObject shm(4096);
  MappingCache cache;
  TensorSpec spec{"group_table", v1::DTYPE_INT32, {-1, -1}, {"max_seqs", "max_groups"}};
  EXPECT_THAT(ResolveTensor(shm.Descriptor(4096, 4000, {4, 8}), spec, cache).status().message(),
              HasSubstr("group_table: offset 4000 + 128 bytes exceeds the 4096-byte allocation"));
}

TEST(DescriptorTest, TwoSizesForOneShmObjectAreRefused) {
  ShmObject shm(4096);
  MappingCache cache;
  TensorSpec spec{"group_table", v1::DTYPE_INT32, {-1, -1}, {"max_seqs", "max_groups"}};
  ASSERT_TRUE(ResolveTensor(shm.Descriptor(4096, 0, {2, 2}), spec, cache).ok());
  spec.name = "block_table";
  EXPECT_THAT(ResolveTensor(shm.Descriptor(8192, 256, {2, 2}), spec, cache).status().message(),
              HasSubstr("block_table.host_shm.size=8192 differs from 4096"));
  EXPECT_EQ(cache.size(), 1u);
}

// The queries as a CUDA IPC tensor whose 64-byte handle repeats `fill`.
v1::MemoryDescriptor IpcQueries(char fill) {
  v1::MemoryDescriptor d;
  d.mutable_cuda_ipc()->set_handle(std::string(64, fill));
  d.set_dtype(v1::DTYPE_FLOAT32);
  for (int64_t dim : {2, 4, 8}) d.add_shape(dim);
  return d;
}

TEST(DescriptorTest, DeviceMemoryIsRefusedWithoutAnIpcOpener) {
  MappingCache cache;  // a cpu session's cache
  const v1::MemoryDescriptor d = IpcQueries('\0');
  const absl::Status s = ResolveTensor(d, QueriesSpec(), cache).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("queries is CUDA device memory"));
}

// Stands in for a CUDA IPC mapping: counts its own destruction.
class FakeDeviceMemory final : public MappedMemory {
 public:
  explicit FakeDeviceMemory(int* destroyed) : destroyed_(destroyed) {}
  ~FakeDeviceMemory() override { ++*destroyed_; }
  std::byte* data() const override { return nullptr; }
  uint64_t size() const override { return 0; }
  const std::string& name() const override { return name_; }
  bool is_device() const override { return true; }

 private:
  int* destroyed_;
  std::string name_ = "<fake cuda ipc>";
};

// Two mappings of one allocation (CUDA hands back the same pointer when one process opens
// one IPC handle twice, which a session does for descriptors that differ only in their
// unchecked `cuda_ipc.device`): the overlap check compares addresses, not mappings, so an
// output laid over an input in the same allocation is still refused.
TEST(DescriptorTest, AnOutputOverlappingAnInputThroughASecondMappingIsRefused) {
  std::vector<std::byte> memory(4096);
  int destroyed = 0;
  const FakeDeviceMemory first(&destroyed), second(&destroyed);  // two mappings of `memory`
  TensorSpec in{"block_table", v1::DTYPE_INT32, {-1, -1}, {"max_seqs", "max_blocks"}};
  TensorSpec out{"visit_count", v1::DTYPE_INT32, {-1}, {"lists"}, /*writable=*/true};
  const MappedTensor a{.data = memory.data(),
                       .shape = {4, 4},
                       .bytes = 64,
                       .memory = &first,
                       .offset = 0,
                       .is_device = true};
  const MappedTensor b{.data = memory.data() + 32,
                       .shape = {8},
                       .bytes = 32,
                       .memory = &second,
                       .offset = 32,
                       .is_device = true};
  EXPECT_THAT(CheckNoOverlap({{in, a}, {out, b}}).message(),
              HasSubstr("visit_count overlaps block_table"));
  const MappedTensor c{.data = memory.data() + 64,
                       .shape = {8},
                       .bytes = 32,
                       .memory = &second,
                       .offset = 64,
                       .is_device = true};
  EXPECT_TRUE(CheckNoOverlap({{in, a}, {out, c}}).ok());
}

// A handle opened and then found unusable is not closed on the Attach's thread (a close
// waits for the device as a free does): the cache keeps it with the session's other
// mappings, which an unfinished cuda session hands to its janitor (Session::DefersDestruction).
TEST(DescriptorTest, AnIpcMappingOpenedButUnusableStaysWithTheCacheUntilItEnds) {
  int destroyed = 0;
  int opened = 0;
  {
    MappingCache cache;
    cache.set_cuda_ipc_opener([&](const v1::CudaIpcHandle&, std::unique_ptr<MappedMemory>* unusable)
                                  -> absl::StatusOr<std::unique_ptr<MappedMemory>> {
      ++opened;
      *unusable = std::make_unique<FakeDeviceMemory>(&destroyed);
      return absl::InternalError("cuMemGetAddressRange failed on an opened IPC handle");
    });
    const v1::MemoryDescriptor d = IpcQueries('\1');
    const absl::Status s = ResolveTensor(d, QueriesSpec(), cache).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kInternal);
    EXPECT_THAT(s.message(), HasSubstr("queries: cuMemGetAddressRange failed"));
    EXPECT_EQ(destroyed, 0) << "closed on the caller's thread";
    EXPECT_EQ(cache.size(), 1u) << "the session must know it holds a mapping";
    // Not handed out again: the same handle is opened anew (and fails again).
    EXPECT_FALSE(ResolveTensor(d, QueriesSpec(), cache).ok());
    EXPECT_EQ(opened, 2);
    EXPECT_EQ(cache.size(), 2u);
    EXPECT_EQ(destroyed, 0);
  }
  EXPECT_EQ(destroyed, 2) << "closed with the cache";
}

TEST(DescriptorTest, AnUnsetMemoryIsRefused) {
  MappingCache cache;
  v1::MemoryDescriptor d;
  d.set_dtype(v1::DTYPE_FLOAT32);
  for (int64_t dim : {2, 4, 8}) d.add_shape(dim);
  EXPECT_EQ(ResolveTensor(d, QueriesSpec(), cache).status().message(), "queries.memory is not set");
}

TEST(DescriptorTest, AnOutputOverlappingAnotherBufferIsRefused) {
  ShmObject shm(4096);
  MappingCache cache;
  TensorSpec in{"block_table", v1::DTYPE_INT32, {-1, -1}, {"max_seqs", "max_blocks"}};
  TensorSpec out{"visit_count", v1::DTYPE_INT32, {-1}, {"lists"}, /*writable=*/true};
  absl::StatusOr<MappedTensor> a = ResolveTensor(shm.Descriptor(4096, 0, {4, 4}), in, cache);
  absl::StatusOr<MappedTensor> b = ResolveTensor(shm.Descriptor(4096, 32, {8}), out, cache);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_THAT(CheckNoOverlap({{in, *a}, {out, *b}}).message(),
              HasSubstr("visit_count overlaps block_table"));
  absl::StatusOr<MappedTensor> c = ResolveTensor(shm.Descriptor(4096, 64, {8}), out, cache);
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(CheckNoOverlap({{in, *a}, {out, *c}}).ok());
}

}  // namespace
}  // namespace eps::service

namespace eps::service {
namespace {

// An inline buffer is a mapping of its own (service/host_memory.h): its initial bytes copied
// in, the rest zero, and the mapping gone with it (mincore answers ENOMEM for an unmapped
// page), so a session's inline memory goes back to the system when the session ends.
TEST(HostMemoryTest, AnInlineBufferIsItsOwnMappingAndGoesWithIt) {
  const uint64_t size = uint64_t{3} << 20;
  auto memory = HostMemory::Allocate(size, std::string("\x01\x02\x03", 3));
  ASSERT_TRUE(memory.ok()) << memory.status();
  std::byte* data = (*memory)->data();
  ASSERT_EQ((*memory)->size(), size);
  EXPECT_EQ(data[0], std::byte{1});
  EXPECT_EQ(data[2], std::byte{3});
  EXPECT_EQ(data[3], std::byte{0});
  EXPECT_EQ(data[size - 1], std::byte{0});
  const long page = sysconf(_SC_PAGESIZE);
  ASSERT_EQ(reinterpret_cast<uintptr_t>(data) % static_cast<uintptr_t>(page), 0u);
  unsigned char resident = 0;
  ASSERT_EQ(mincore(data, static_cast<size_t>(page), &resident), 0);
  memory->reset();
  for (const uint64_t offset : {uint64_t{0}, size / 2, size - static_cast<uint64_t>(page)}) {
    errno = 0;
    EXPECT_EQ(mincore(data + offset, static_cast<size_t>(page), &resident), -1) << offset;
    EXPECT_EQ(errno, ENOMEM) << offset;
  }
}

}  // namespace
}  // namespace eps::service
